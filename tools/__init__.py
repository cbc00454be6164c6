"""Developer tools: run from the project root as modules (python -m tools.sass_digest ...)."""
