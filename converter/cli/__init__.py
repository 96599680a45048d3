"""The converter's command line: commands, rendering, path arguments."""
