"""Fake of the compiled extension `deepinfer._C`."""
