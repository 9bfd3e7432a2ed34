"""``bucketrl agent-router``: one URL for agents in front of every generator's OpenAI-compatible endpoint."""
