"""Models: a from-scratch GPT and transformers builders from offline presets."""
