"""Custom kernels, each with a plain-JAX reference: few-row products and flash decoding (Pallas), grouped matmuls of
experts (Mosaic GPU), fp8 products (XLA), and the optional Transformer Engine adapter."""
