"""Standard-library-only helpers that every layer of the package may use.

Nothing here imports the rest of the package: the janitor (sandbox.cleanup) runs `safefs` in a
bare interpreter."""
