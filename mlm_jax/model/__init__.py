"""The model: a decoder-only Transformer and its layers, written once with logical axis names (`axes`) and
parallelism-agnostic; the implementations a layer runs are passed to it (`kernels.Kernels`)."""
