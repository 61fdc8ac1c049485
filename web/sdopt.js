// sdopt: shows the profile table that SDOptProfileReport returns in its UI "text" output.
import { app } from "../../scripts/app.js";
import { ComfyWidgets } from "../../scripts/widgets.js";

const REPORT_NODE = "SDOptProfileReport";
const WIDGET_NAME = "sdopt_profile";

function showReport(node, text) {
  let widget = node.widgets?.find((w) => w.name === WIDGET_NAME);
  if (!widget) {
    widget = ComfyWidgets.STRING(node, WIDGET_NAME, ["STRING", { multiline: true }], app).widget;
    widget.inputEl.readOnly = true;
    widget.inputEl.style.fontFamily = "monospace";
    widget.inputEl.style.fontSize = "11px";
    // The table is output, not input: keep it out of the saved workflow and the prompt.
    widget.serialize = false;
    widget.options = { ...widget.options, serialize: false };
    // Grow with the table instead of hiding it behind a scrollbar next to the chart.
    widget.options.getMinHeight = () => String(widget.value ?? "").split("\n").length * 15 + 16;
  }
  widget.value = text;
  requestAnimationFrame(() => {
    const size = node.computeSize();
    node.setSize([Math.max(size[0], node.size[0], 520), Math.max(size[1], node.size[1])]);
    app.graph.setDirtyCanvas(true, false);
  });
}

app.registerExtension({
  name: "sdopt.ProfileReport",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData.name !== REPORT_NODE) return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      showReport(this, (message?.text ?? []).join("\n"));
    };
  },
});
