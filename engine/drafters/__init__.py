"""Drafting sources (Medusa heads, the Kangaroo adapter, lookup, the datastore, grammars),
their composition, Auto, the method registry, stored accelerators and what a drafter's step
is worth here. Imports the foundation, datastore, decode, weights, lean and model.
"""
