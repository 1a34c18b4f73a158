"""Optimizers (Muon with AdamW) and learning-rate schedules."""
