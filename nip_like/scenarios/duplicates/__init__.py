"""The duplicates task: does a list of values hold two equal ones?

Only the data layer exists so far (:mod:`nip_like.scenarios.duplicates.data`);
this package registers no scenario, and imports nothing on its own.
"""
