"""Helpers the tests share, by what they serve (test modules import from here, never from each other)."""
