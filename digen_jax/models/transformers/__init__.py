"""The denoising transformers: Qwen-Image's MMDiT, FLUX.1, Wan2.1, the config and
model bases they share (dit), their layers, RoPE and scanned block stacks."""
