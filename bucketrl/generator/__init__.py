"""bucketrl generator."""
