"""orbax I/O: the canonical train state (sharded, async, atomic; any layout resumes any other) and weights-only
checkpoints (converted models, `load_pretrained`)."""
