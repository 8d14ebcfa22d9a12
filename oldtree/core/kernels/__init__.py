"""Portable kernels (Triton) shared by several backends. Importing this package never imports triton."""
