"""Scripts that other engines' Pythons run for `tilecore bench … --peer-python`.

Nothing in tilecore imports these modules: each runs as a script in a separate
interpreter that has the peer installed (torch, fbgemm-gpu-cpu), so their imports
are not tilecore's dependencies.
"""
