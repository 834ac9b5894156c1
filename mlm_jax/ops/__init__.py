"""Custom kernels, each with a plain-JAX reference: few-row products and flash decoding (Pallas), grouped matmuls of
experts (Mosaic GPU), fp8 products (XLA), documents kept apart by cuDNN's packed attention layout, and the optional
Transformer Engine adapter."""
