"""bucketrl up."""
