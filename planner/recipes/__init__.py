"""Recipe axes, each a small registry of its values: precision and optimizers, fine-tuning
(LoRA/QLoRA), the loss, the training loop."""
