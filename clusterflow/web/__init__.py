"""``clusterflow dashboard``: the runs and sweeps under some folders, live in the browser.

- ``discover.py``: which runs and sweeps are under the PATHs (searched again as they change);
- ``feeds.py``: what an open page follows as it grows (metrics, logs), read on from offsets;
- ``catalog.py``: every run's summary from the readers that own it, kept fresh by one poll;
- ``views.py``: what each page gets (chosen fields only);
- ``server.py``: the Starlette app under uvicorn: pages, streams, cancel;
- ``guard.py``: in front of every request: the Host header, the token, the security headers
  (and why no cookie);
- ``templates/``, ``static/``: the pages (Jinja2 shells that hold no data) and their script,
  which asks for the data with the token; charts are Plotly's, served from the plotly package.

It only reads the run dirs; the one action, cancel, is ``clusterflow cancel``'s code.
"""
