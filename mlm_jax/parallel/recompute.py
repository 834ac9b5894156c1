"""What a backward recomputes rather than keeps: elementwise and layout primitives, cheap next to the memory they
would take. One list for both places that choose: the pipeline's stash (`stash_policy`: what a chunk's forward keeps
for its backward) and zero-bubble's split backward (`split_vjp`: what W recomputes from residuals rather than have B
keep)."""
from __future__ import annotations

CHEAP = frozenset({
    "abs", "add", "add_any", "and", "broadcast_in_dim", "ceil", "clamp", "concatenate", "convert_element_type",
    "copy", "copy_p", "cos", "div", "eq", "erf", "exp", "exp2", "expand_dims", "floor", "ge", "gt", "integer_pow",
    "iota", "is_finite", "le", "log", "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg", "not", "or",
    "pad", "pow", "reduce_precision", "rem", "reshape", "reshard", "rev", "round", "rsqrt", "select_n",
    "sharding_constraint", "sign", "sin", "slice", "split", "sqrt", "square", "squeeze", "stop_gradient", "sub", "tan",
    "tanh", "transpose", "xor"})


def stash_policy(prim, *_, **__) -> bool:
    """What a chunk's forward keeps for its backward (a `jax.checkpoint` policy): the outputs of matmuls, attention
    kernels, reductions and collectives. Elementwise results (norm and activation intermediates, fp32 upcasts, casts
    and transposes of the weights) are recomputed inside the backward's fusions, as XLA does in a program that holds
    forward and backward together; stashing them would copy 3x the bytes into the stash at every tick (measured at
    llama-1b: the copies took 20% of the step). Layout constraints (`reshard`, `sharding_constraint`) are recomputed
    too: kept, each would stash a second copy of the product or norm output it lays out (at llama-1b they were 30% of
    the stash's bytes); where one is a collective (sequence parallelism's gather), the backward gathers again, as
    Megatron-LM's sequence parallelism does."""
    return prim.name not in CHEAP
