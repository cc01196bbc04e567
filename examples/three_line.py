"""apex.amp's three-line integration, with apex_amp (the three amp lines are marked)."""

import torch
from apex_amp import amp

model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16)  # 1

x, y = torch.randn(256, 32), torch.randint(0, 4, (256,))
for step in range(20):
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    with amp.scale_loss(loss, optimizer) as scaled_loss:  # 2
        scaled_loss.backward()  # 3
    optimizer.step()
print(f"loss {loss.item():.4f}")
