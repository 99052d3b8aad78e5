"""cpsparse benchmarks (GPU): each module has a ``main()`` and writes JSON results."""
