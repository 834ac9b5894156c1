"""Inference on a trained or converted model: decode-time blocks and the key/value cache, prefill and decode
steps, generation, and `load_pretrained`."""
