"""Drafter training: prompt sources, target regeneration and the training loops for the trained drafters."""
