"""The proxy: the FastAPI control plane over Redis (coordination) and the bucket (durable truth)."""
