"""Building blocks shared by model families: the attention contract, RoPE, norms."""
