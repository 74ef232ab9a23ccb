"""LoRA adapters: low-rank updates of a base model's weights, kept apart from them."""
