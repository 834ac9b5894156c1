"""FP8 matmuls (model.precision=fp8): quantization, forward and gradient numerics, and training, on CPU; and the
Transformer Engine adapter (attention_impl=te, precision=fp8_te) through a stand-in module."""
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx

from mlm_jax import Trainer, load_config
from mlm_jax.ops.fp8 import E4M3, E5M2, fp8_einsum, quantize
from mlm_jax.model.transformer import Transformer
from mlm_jax.model.transformer import model_spec


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("fp8_dtype, mantissa_bits", [(E4M3, 3), (E5M2, 2)])
def test_quantize_keeps_the_max_and_relative_precision(fp8_dtype, mantissa_bits):
    x = jax.random.normal(jax.random.key(0), (64, 256)) * 1e-3
    q, scale = quantize(x, fp8_dtype)
    assert q.dtype == fp8_dtype
    back = q.astype(jnp.float32) * scale
    assert float(jnp.max(jnp.abs(back))) == pytest.approx(float(jnp.max(jnp.abs(x))), rel=2.0 ** -mantissa_bits)
    normal = jnp.abs(x) > 1e-2 * jnp.max(jnp.abs(x))  # away from the subnormal range
    worst = float(jnp.max(jnp.where(normal, jnp.abs(back - x) / jnp.abs(x), 0)))
    assert 0 < worst <= 2.0 ** -(mantissa_bits + 1) * 1.001  # round to nearest: half a unit in the last place


def test_quantize_zero_and_extremes_stay_finite():
    q, scale = quantize(jnp.zeros((8, 8)), E4M3)
    assert float(scale) == 1.0 and not np.any(np.asarray(q.astype(jnp.float32)))
    x = jnp.array([3e38, -3e38, 1.0, 0.0])
    q, scale = quantize(x, E4M3)
    assert np.all(np.isfinite(np.asarray(q.astype(jnp.float32) * scale)))


@pytest.mark.parametrize("equation, x_shape, w_shape", [
    ("bsd,df->bsf", (2, 16, 64), (64, 96)),
    ("bsd,dnh->bsnh", (2, 16, 64), (64, 4, 16)),
    ("bsnh,nhd->bsd", (2, 16, 4, 16), (4, 16, 64)),
])
def test_fp8_einsum_and_its_gradients_approximate_the_exact_ones(equation, x_shape, w_shape):
    kx, kw, kg = jax.random.split(jax.random.key(1), 3)
    x, w = jax.random.normal(kx, x_shape), jax.random.normal(kw, w_shape) * 0.05
    g = jax.random.normal(kg, jnp.einsum(equation, x, w).shape)

    def loss(f, x, w):
        return jnp.sum(f(x, w) * g)

    exact = jax.value_and_grad(lambda x, w: loss(lambda a, b: jnp.einsum(equation, a, b), x, w), (0, 1))(x, w)
    fp8 = jax.value_and_grad(lambda x, w: loss(lambda a, b: fp8_einsum(equation, a, b), x, w), (0, 1))(x, w)
    y_exact, y_fp8 = jnp.einsum(equation, x, w), fp8_einsum(equation, x, w)
    assert 1e-3 < rel(y_fp8, y_exact) < 0.05  # really quantized, and close
    for got, ref in zip(fp8[1], exact[1]):
        assert got.shape == ref.shape and got.dtype == ref.dtype
        assert 1e-3 < rel(got, ref) < 0.08  # e5m2 gradients carry one mantissa bit less


def test_fp8_einsum_in_float16_stays_finite_and_accurate():
    """The unscaled fp8 products (448^2, and 448 * 57344 for e5m2 gradients, per term) overflow float16: the dots
    return fp32 and only the scaled result is cast."""
    equation = "bsd,df->bsf"
    kx, kw, kg = jax.random.split(jax.random.key(2), 3)
    x_BSD = jax.random.normal(kx, (2, 64, 2048)).astype(jnp.float16)
    w_DF = (jax.random.normal(kw, (2048, 256)) * 0.02).astype(jnp.float16)
    g_BSF = jax.random.normal(kg, (2, 64, 256)).astype(jnp.float16)
    f32 = lambda a: a.astype(jnp.float32)
    y_exact, vjp_exact = jax.vjp(lambda x, w: jnp.einsum(equation, x, w), f32(x_BSD), f32(w_DF))
    y_fp8, vjp_fp8 = jax.vjp(lambda x, w: fp8_einsum(equation, x, w), x_BSD, w_DF)
    assert y_fp8.dtype == jnp.float16 and np.all(np.isfinite(np.asarray(y_fp8)))
    assert 1e-3 < rel(y_fp8, y_exact) < 0.05
    for got, ref in zip(vjp_fp8(g_BSF), vjp_exact(f32(g_BSF))):
        assert got.dtype == jnp.float16 and np.all(np.isfinite(np.asarray(got)))
        assert 1e-3 < rel(got, ref) < 0.08


def test_fp8_program_contains_fp8_dots():
    x, w = jnp.ones((2, 8, 32), jnp.bfloat16), jnp.ones((32, 16), jnp.bfloat16)
    f = jax.jit(jax.value_and_grad(lambda x, w: fp8_einsum("bsd,df->bsf", x, w).astype(jnp.float32).sum(), (0, 1)))
    dots = [line for line in f.lower(x, w).as_text().splitlines() if "dot_general" in line]
    assert len(dots) == 3 and all(line.split(":")[-1].split("->")[0].count("xf8E") == 2 for line in dots)  # fwd, dgrad, wgrad


BASE = ["train.steps=40", "train.log_every=40", "train.eval_every=0", "train.global_batch_size=8", "model.num_layers=2",
        "train.seq_len=64", "log.progress=never", "data.max_bytes=2000000", "parallel.data=1",
        "checkpoint.save=false"]


def test_fp8_training_tracks_bf16_and_composes_with_tensor_parallelism(tmp_path):
    def final_loss(overrides, devices):
        cfg = load_config(None, BASE + [f"train.output_dir={tmp_path / str(len(overrides))}"] + overrides)
        return Trainer(cfg, devices=jax.devices()[:devices]).fit()[-1]["loss"]

    bf16 = final_loss([], 1)
    fp8 = final_loss(["model.precision=fp8"], 1)
    fp8_tp = final_loss(["model.precision=fp8", "parallel.data=2", "parallel.tensor=2",
                         "parallel.sequence_parallel=true", "model.dtype=float32"], 4)
    assert bf16 < 3.5  # it learned (about 5.5 at the start)
    assert abs(fp8 - bf16) / bf16 < 0.03
    assert abs(fp8_tp - bf16) / bf16 < 0.03


FAKE_TE = {  # the parts of Transformer Engine 2.x's JAX API that layers/te.py calls, computed with plain JAX
    "transformer_engine/__init__.py": "",
    "transformer_engine/common/__init__.py": "",
    "transformer_engine/common/recipe.py": "class Float8CurrentScaling:\n    pass\n",
    "transformer_engine/jax/__init__.py": (
        "import contextlib\n"
        "@contextlib.contextmanager\n"
        "def fp8_autocast(enabled=False, fp8_recipe=None):\n"
        "    yield\n"),
    "transformer_engine/jax/quantize.py": (
        "class QuantizerFactory:\n"
        "    @staticmethod\n"
        "    def create_set():\n"
        "        return 'quantizers'\n"),
    "transformer_engine/jax/dense.py": (
        "import jax\n"
        "def dense(x, kernel, contracting_dims, quantizer_set):\n"
        "    assert quantizer_set == 'quantizers'\n"
        "    return jax.lax.dot_general(x, kernel, (contracting_dims, ((), ())))\n"),
    "transformer_engine/jax/attention.py": (
        "import enum, jax\n"
        "AttnBiasType = enum.Enum('AttnBiasType', 'NO_BIAS')\n"
        "AttnMaskType = enum.Enum('AttnMaskType', 'CAUSAL_MASK')\n"
        "QKVLayout = enum.Enum('QKVLayout', 'BSHD_BSHD_BSHD')\n"
        "def fused_attn(qkv, bias, mask, seed, *, attn_bias_type, attn_mask_type, qkv_layout, scaling_factor,\n"
        "               dropout_probability, is_training):\n"
        "    assert attn_mask_type is AttnMaskType.CAUSAL_MASK and qkv_layout is QKVLayout.BSHD_BSHD_BSHD\n"
        "    return jax.nn.dot_product_attention(*qkv, scale=scaling_factor, is_causal=True)\n"),
}


@pytest.fixture
def fake_transformer_engine(tmp_path, monkeypatch):
    for path, text in FAKE_TE.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in [n for n in sys.modules if n.split(".")[0] == "transformer_engine"]:
        del sys.modules[name]


def test_transformer_engine_adapter_computes_the_same_model(fake_transformer_engine):
    """The adapter's layouts and contraction dims, checked through a stand-in that computes with plain JAX."""
    tokens = jnp.arange(32).reshape(2, 16) % 500
    logits = {}
    for impl, precision in (("xla", "bf16"), ("te", "fp8_te")):
        cfg = load_config(None, ["model.dtype=float32", "model.num_kv_heads=2", f"model.attention_impl={impl}",
                                 f"model.precision={precision}"])
        model_spec(cfg.model)  # the availability check passes
        logits[impl] = Transformer(cfg.model, rngs=nnx.Rngs(0))(tokens)
    np.testing.assert_allclose(logits["te"], logits["xla"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("option", ["model.attention_impl=te", "model.precision=fp8_te"])
def test_transformer_engine_options_without_it_are_one_line_errors(option):
    result = subprocess.run([sys.executable, "-m", "mlm_jax.train", option, "train.steps=1"], capture_output=True,
                            text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"error: {option} needs Transformer Engine") and result.stderr.count("\n") == 1
