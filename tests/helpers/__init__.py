"""What several test files share: the repository's paths, the CLI case runner, the pipeline
runs, the parity helpers. Test files import from here, never from each other."""
