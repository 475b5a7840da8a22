"""Sweeps (``submit --sweep KEY=V1,V2``) as data, before anything is submitted.

- ``sweep.py``: the axes expanded into validated members, each with a readable name;
- ``index.py``: the sweep index ``sweep.json``, its lock, and what a resubmission does with each
  member.

Submitting them is ``launch/sweep.py``; their status ``manage/sweep_status.py``.
"""
