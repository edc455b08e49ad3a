"""The node agent (stdlib-only code shipped to nodes) and its head-side session.

Modules named in ``NODE_MODULES`` run *on the nodes*: stdlib only, Python
3.8+, never importing ``corral``.  ``bundle`` packs them for the wire;
``session`` drives them from the head.
"""
