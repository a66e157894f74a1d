"""Test scaffolding: toys, references, checks and the device self-check (never imported by runtime packages)."""
