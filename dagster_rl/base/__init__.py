"""The foundation every layer builds on, importing nothing of dagster_rl but itself: errors, content
hashes, bounds, the strict settings base. `store`, `runtime`, `sandbox` and `inference` build on
this alone; `core` (the loop's concepts) builds on it and on them (tests/test_layout.py holds both).

    errors       the project's errors (DagsterRLError and its kinds)
    hashing      canonical JSON, content hashes, cache keys, seeds
    bounds       every upper bound of a setting
    strict       the settings base (unknown fields are errors, numbers are numbers), the record base
    differences  what differs between two computations of one artifact
    retries      limits and retries
    faults       seeded fault injection
    counters     call counts (what a test asserts was, or was not, computed again)
    plugins      user code an experiment imports: a file in the experiments folder, or a module, and
                 installed `dagster_rl.plugins` entry points
"""
