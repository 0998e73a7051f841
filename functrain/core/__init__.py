"""The pure core: TrainState, the step, optimizer factories, precision, losses, model programs and the Backend
protocol the loop drives. Nothing here reads a config or touches the disk."""
