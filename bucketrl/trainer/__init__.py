"""bucketrl trainer."""
