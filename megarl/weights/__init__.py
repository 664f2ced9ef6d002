"""megarl.weights"""
