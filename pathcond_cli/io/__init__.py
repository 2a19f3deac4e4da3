"""Files: reading and writing checkpoints (``formats``: ONNX, safetensors, specs, torch.fx import),
atomic staged writes and output destinations. Imports ``engine`` and ``errors``."""
