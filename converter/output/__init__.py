"""The output directory: its layout, records of what was written, the session that
owns it while a run writes, its final files and its lock."""
