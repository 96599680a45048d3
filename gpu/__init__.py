"""GPU validation of the converted checkpoint through the adapter's FlashInfer module."""
