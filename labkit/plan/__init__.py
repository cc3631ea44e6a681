"""PLAN: choose a training recipe for a model and a memory budget, and export it as runnable configuration."""
