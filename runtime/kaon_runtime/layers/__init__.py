"""Model building blocks: norm, rotary, activation, attention, sampler."""
