"""Training: text to tokens (corpus, tokenizer, data), the model, and the inner steps (trainer)."""
