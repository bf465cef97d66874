"""TreeFlash: a one-pass block tree drafter from the target's hidden states, with a conditional head."""
