"""The content-addressed artifact store: its caching rules, and the storage they run on.

artifact_store  `ArtifactStore`: the rules: `get_or_put`, adopt or conflict, partials, quarantine
layout          what a key, kind and file name may be, and where each lies under the root
storage         `Storage`, what the rules need of the files under a URL; `open_storage(url)`
local_storage   `LocalStorage`: a local folder, every path walked without following a link
fsspec_storage  `FsspecStorage`: any other fsspec URL (object stores: no rename, no links)
nofollow        files under a root reached without following a symbolic link
"""
