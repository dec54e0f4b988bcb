"""kvreuse's own CPU kernels, built from source on first use (once per machine, torch and source) into the cache
directory, and registered as torch ops so that torch.compile graphs call them."""
