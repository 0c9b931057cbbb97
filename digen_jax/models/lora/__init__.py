"""LoRA adapters: targets, initialization, merge and manifests."""
