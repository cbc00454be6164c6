def rewrite(ctx, available):
    pass
