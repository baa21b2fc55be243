from pretrain.train import main

main()
