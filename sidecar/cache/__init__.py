"""Response cache: exact keys and semantic ("same question?") hits."""
