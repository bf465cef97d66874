"""Training of the demo model pair: an offline corpus, a hybrid target LM and a Mamba2 drafter distilled from it."""
