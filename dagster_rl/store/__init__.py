"""The content-addressed artifact store.

    artifact_store  `ArtifactStore`: keys, `get_or_put`, adopt or conflict, partials, quarantine
    nofollow        files under a root reached without following a symbolic link
"""
