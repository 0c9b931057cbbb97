"""The VAEs that decode latents: Qwen-Image's (qwen_vae) and Wan's over the causal video
network, FLUX.1's AutoencoderKL, and their shared blocks."""
