"""Contract and policy layer: the contract model, compiler, signing and distribution.

Imports no other layer of the project; everything else reads what it produces.
"""
