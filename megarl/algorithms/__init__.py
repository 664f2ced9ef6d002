"""megarl.algorithms"""
